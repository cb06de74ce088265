from dflash_ring.cli import main

if __name__ == "__main__":  # spawned workers re-import this module
    raise SystemExit(main())
