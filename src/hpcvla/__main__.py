from hpcvla.cli import main

raise SystemExit(main())
