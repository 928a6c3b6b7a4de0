from accum_cli.cli import entry

entry()
