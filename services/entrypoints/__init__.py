"""Every process's `main` and the `shinkai` command: the top layer, which assembles the layers below into processes."""
