"""One module per `zerotrain` verb (the table is zerotrain.launcher.cli.COMMANDS). Commands are the
top layer: they may import everything below (the run, components, config, errors, dataio, modeling)
and each other, and nothing imports them except the CLI table and the entry scripts."""
