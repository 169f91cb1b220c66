from accucheck.cli import main

if __name__ == "__main__":  # vLLM's engine may start processes that import this module again
    main()
