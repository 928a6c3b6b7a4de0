from accum_cli.cli.main import entry

entry()
