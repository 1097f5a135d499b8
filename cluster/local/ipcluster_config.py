# labkit: engines on this machine, one per rank (CPU or one per GPU of this machine).
#
#   ipython profile create labkit_local --parallel
#   cp cluster/local/ipcluster_config.py ~/.ipython/profile_labkit_local/
#   ipcluster start --profile=labkit_local -n 4 --daemonize
#   # notebook:  lab = labkit.Lab.connect(profile="labkit_local", engines=4)
#   ipcluster stop --profile=labkit_local
#
# You rarely need this: labkit.Lab.start(engines=4) does the same from the notebook, with
# RANK/LOCAL_RANK set per engine. Engines started here carry no rank variables, so the lab
# assigns ranks (by host, then process id) and local ranks count per host.
c = get_config()  # noqa: F821  (ipcluster provides get_config)

c.Cluster.engine_launcher_class = "local"
# Only this machine can reach the controller (messages are signed, not encrypted).
c.Cluster.controller_ip = "127.0.0.1"
# Engines: as many as GPUs on this machine (or CPU ranks you want); `-n` overrides it.
c.Cluster.n = 2
# gloo over loopback, a few threads per engine so they do not fight over the cores.
c.LocalEngineSetLauncher.environment = {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
