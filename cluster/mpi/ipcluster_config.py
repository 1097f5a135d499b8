# labkit: engines started by mpirun (Open MPI), one rank per GPU.
#
#   ipython profile create labkit_mpi --parallel
#   cp cluster/mpi/ipcluster_config.py ~/.ipython/profile_labkit_mpi/
#   ipcluster start --profile=labkit_mpi -n 8 --daemonize
#   # notebook:  lab = labkit.Lab.connect(profile="labkit_mpi", engines=8)
#   # or:        lab = labkit.Lab.start(engines=8, launcher="mpi", hosts=["node1:4", "node2:4"])
#   ipcluster stop --profile=labkit_mpi
#
# Ranks come from OMPI_COMM_WORLD_RANK, local ranks from OMPI_COMM_WORLD_LOCAL_RANK (MPICH and
# Intel MPI: PMI_RANK / MPI_LOCALRANKID). Engines need mpi4py (`pip install mpi4py`), which
# loads the system's MPI library. labkit's own MPI launcher (Lab.start(launcher="mpi")) also
# forwards the engines' variables to other nodes with -x; with ipcluster, name them yourself.
c = get_config()  # noqa: F821

c.Cluster.engine_launcher_class = "mpi"
# Every interface, so ranks on other hosts reach the controller: trusted network only.
c.Cluster.controller_ip = "*"

c.MPIEngineSetLauncher.mpi_cmd = ["mpirun"]
c.MPIEngineSetLauncher.mpi_args = [
    "--host", "node1:4,node2:4",      # host:slots, slots = GPUs on that host; ranks fill node1 first
    "--map-by", "slot",
    # "--oversubscribe",              # more ranks than cores/slots (CPU-only tests)
    "-x", "IPP_CONNECTION_INFO", "-x", "IPP_CLUSTER_ID", "-x", "IPP_PROFILE_DIR",
    "-x", "PATH", "-x", "LD_LIBRARY_PATH",
]
# The engines' Python, same path on every host.
# c.MPIEngineSetLauncher.engine_cmd = ["/shared/me/labkit/.venv/bin/python", "-m", "ipyparallel.engine"]

# Running as root (containers): Open MPI refuses unless both are set.
# c.MPIEngineSetLauncher.environment = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
