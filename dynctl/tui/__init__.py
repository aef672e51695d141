"""The Textual dashboard (`dynctl tui`): `dynctl.tui.app.create_app`. Only this package and dynctl.cli import textual.

Kept empty so that `dynctl.tui.actions` (the protocol the core implements) imports without textual.
"""
