"""Command-line tools: cli, bench, gpu_check, simulate."""
