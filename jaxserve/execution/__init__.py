"""Execution on the device: the step's device batch and its packing, the pure jitted step, its compiled
programs (buckets, warm-up, the program cache), the runner that launches steps and collects their samples,
and the multi-host relay that wraps it."""
