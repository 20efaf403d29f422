"""What a config will cost before launching, for make estimate-memory, make choose-config and their benchmarks.

memory     memory per rank by category for a model under a config
step_time  the configs ranked for a job by estimated memory and step time
"""
