from target_server.data.cli import main

raise SystemExit(main())
