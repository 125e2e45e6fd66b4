"""The measurement harness: the command line checked once (command_line.py, config.py), then the run
loop (run.py) measures one variant's time and peak memory (measure.py, memory.py) at each sequence
length and hands each row to its sinks (results.py's store and status, logger.py's wandb run,
console.py's view); quality/ says what the variant loses, report/ reads the results back. It never
defines attention: variants/ does.
"""

from . import config  # noqa: E402,F401  registers the resolver conf/config.yaml names (job_dirname)
