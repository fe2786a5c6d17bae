"""Several devices and processes: tensor, expert and data parallelism; multi-host."""
