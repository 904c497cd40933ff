from lightning_opd.cli import main

main()
