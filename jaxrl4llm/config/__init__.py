"""Configuration and the command line: config trees whose leaf fields are the options
(options.py), the user-error classes and exit codes (errors.py), and the absl flags generated
from a config tree with the entry points' error contract (cli.py).

options.py and errors.py sit at the bottom layer (every package may use them); cli.py imports
absl and sits above train/, so this file imports none of them.
"""
