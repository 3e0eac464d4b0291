"""How data moves between ranks (docs/architecture.md describes the planes). Each mechanism
stands on its own:

* `records`: the fixed binary layout of a record (named numpy arrays, never pickle);
* `ring`: the trajectory ring, producers -> one learner through one-sided RMA (data plane);
* `exchange`: node-local observation/action slots in a shared-memory window (data plane);
* `weights`: versioned, topology-aware weight broadcast (control plane);
* `slots`, `progress`, `backoff`, `windows`: the ring's slot format, MPI progress for remote
  producers, sleeping waits, and a window's memory as numpy;
* `ring_window`, `ring_writer`, `ring_reader`: the ring's window, a producer's side and the
  learner's side; `segment_meta`: a segment's metadata by name; `manifest`: the weight
  plane's flat layout; `pieces`: messages of any size in pieces MPI's int counts take.

All but `records`, `slots`, `backoff`, `windows`, `manifest` and `segment_meta` import mpi4py;
import them only inside MPI ranks.
"""
