from kiamfast.control.process import main

raise SystemExit(main())
