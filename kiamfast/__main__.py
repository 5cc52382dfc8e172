from kiamfast.cli import main

raise SystemExit(main())
