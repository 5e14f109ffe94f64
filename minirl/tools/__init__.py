"""What no loop imports: the dry-run plan, the rehearsal (and its C++ shim), eval, export and plot."""
