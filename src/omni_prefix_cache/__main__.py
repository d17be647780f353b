from omni_prefix_cache.cli import main

raise SystemExit(main())
