from kdbench.cli import main

raise SystemExit(main())
