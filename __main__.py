from dflash_ring.cli import main

raise SystemExit(main())
