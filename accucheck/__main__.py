from accucheck.cli import main

main()
