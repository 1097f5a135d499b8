"""The planner at cluster scale: pure arithmetic on a GPU preset (:mod:`.hardware`), a model's
shape (:mod:`.model`) and a strategy placed on the cluster (:mod:`.layout`): step time and MFU
(:mod:`.step`), memory per GPU (:mod:`.memory`), each axis's traffic by tier (:mod:`.traffic`),
the ranked search (:mod:`.search`) and the published tables it is checked against
(:mod:`.published`). Its pipeline timeline runs on the same event-driven core as the local
planner's (:mod:`.simulation`)."""
