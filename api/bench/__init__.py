"""Measurement of the running service from the outside: `bench-api`, `make load`, `make fuzz`, the latency probe,
the WebSocket client timer and the real-service launcher they share. The service never imports this package
(tests/test_layers.py)."""
