from kiamfast.control.start import main

raise SystemExit(main())
