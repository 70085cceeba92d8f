"""The pfl-edge server: FastAPI coordination and aggregation, MQTT control plane, SQL state, blob store.

Entry points: :func:`server.app.create_app` (the app factory), :func:`server.main.serve` (the ``pfl-edge server``
command) and :func:`server.main.start_background` (a whole server on a free port, for tests and demos).
"""
