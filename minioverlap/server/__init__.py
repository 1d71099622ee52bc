# >>> ch16 file: the server
"""`minioverlap serve`: an OpenAI-compatible HTTP server (api.py, protocol.py, text.py) in one process,
the scheduler in another (engine.py), two pipes between them (client.py), started and stopped by
launch.py."""
