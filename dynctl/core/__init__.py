"""The core, UI-free: deploy, lifecycle, operations, native, inventory, adoption, fleets and rollouts."""
