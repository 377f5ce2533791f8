"""Run reports: plots and an HTML page over one or more training stages."""
