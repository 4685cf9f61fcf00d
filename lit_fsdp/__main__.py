"""``python -m lit_fsdp COMMAND``: the application's entry point (``lit_fsdp.commands.main``)."""

from lit_fsdp.commands.main import main

if __name__ == "__main__":
    main()
