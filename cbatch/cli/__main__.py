from cbatch.cli.app import main

main()
