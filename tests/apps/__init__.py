"""Play registries for tests, loadable by subprocess workers.

``worker start --app tests.apps.plays:registry`` with the repository root on PYTHONPATH.
"""
