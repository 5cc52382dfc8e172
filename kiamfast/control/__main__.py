from kiamfast.control.main import main

raise SystemExit(main())
