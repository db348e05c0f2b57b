"""A choice's text as a client reads it: the thinking split off (`reasoning.py`, `--reasoning-parser`), the
answer, and the tool calls found in it (`reader.py`, over `server/tools/`), whole or as it streams."""
