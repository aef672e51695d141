from dynctl.cli import main

main()
