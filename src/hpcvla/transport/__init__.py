"""How data moves between ranks (DESIGN.md section 2). Each mechanism stands on its own:

* `records`: the fixed binary layout of a record (named numpy arrays, never pickle);
* `ring`: the trajectory ring, producers -> one learner through one-sided RMA (data plane);
* `exchange`: node-local observation/action slots in a shared-memory window (data plane);
* `weights`: versioned, topology-aware weight broadcast (control plane).

`ring`, `exchange` and `weights` import mpi4py; import them only inside MPI ranks.
"""
