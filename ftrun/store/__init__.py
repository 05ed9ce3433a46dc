"""A job's store: the key layout, client connections, the hosted server, mailboxes, leases and plans.

- :mod:`~ftrun.store.keys`: every key ftrun uses (imports nothing: the worker runtime uses it too);
- :mod:`~ftrun.store.kv`: :class:`KeyValue`, the operations a backend provides (torch's TCPStore has them);
- :mod:`~ftrun.store.job`: :class:`JobStore`, the one interface the agent, ``ftrun status`` and
  ``ftrun inject`` use: records, mailboxes, leases, plans, every value sealed with the run's secret;
- :mod:`~ftrun.store.auth`: the run's secret and the seal (HMAC-SHA256 over key and value);
- :mod:`~ftrun.store.client`: client connections to a job's TCPStore; :mod:`~ftrun.store.host`: hosting one;
- :mod:`~ftrun.store.mailbox`: the thread that reads a mailbox; :mod:`~ftrun.store.leases`: node leases.

Importing this package imports neither torch nor any launcher code.
"""
