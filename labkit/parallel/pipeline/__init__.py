"""Pipeline parallelism: schedules as data (:mod:`.schedules`), the stage split and the executor (:mod:`.stages`)."""
