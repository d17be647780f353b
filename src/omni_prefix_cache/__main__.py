from omni_prefix_cache.tools.cli import main

raise SystemExit(main())
