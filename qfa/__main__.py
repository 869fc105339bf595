from qfa.cli import main

raise SystemExit(main())
