"""TEST DOUBLE package standing in for sglang (not SGLang): see launch_server.py."""
