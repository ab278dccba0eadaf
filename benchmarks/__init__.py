"""The benchmarks: scripts that measure tokengate side by side (with direct access, with the
peer routers, strategy against strategy) on the load harness (``loadtests``), and their
dated results (``results/``). ``common`` holds what every script shares."""
