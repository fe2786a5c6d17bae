"""The engine and what it drives: scheduler, prefix cache, async scheduling, faults, batch builder, runner, sampler, outputs."""
