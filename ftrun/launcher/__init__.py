"""Starting a launch: this node's agent, or one agent per host (ssh), and the hand-off each agent receives.

- :mod:`~ftrun.launcher.launch`: the entry point from the command line;
- :mod:`~ftrun.launcher.multihost`: ``--hostfile`` / ``-H``: host the store here, start one agent per host;
- :mod:`~ftrun.launcher.handoff`: the versioned description of its part of the job each agent is given;
- :mod:`~ftrun.launcher.ssh`: commands on other hosts over ssh; :mod:`~ftrun.launcher.hosts`: hostfiles,
  host lists, and which names are this machine; :mod:`~ftrun.launcher.slurm`: a Slurm allocation's nodes.
"""
