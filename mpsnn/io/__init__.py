"""Saving and loading mpsnn objects (the role of MPS's ``NSSecureCoding``): `save`, `load`, and
the codec table that says how each class is written and rebuilt.

File format (version 1)
-----------------------

One safetensors file. Its tensors hold every tensor of the saved objects (CPU, contiguous,
in their own dtype); its header's ``__metadata__`` map holds one key, ``"mpsnn"``, whose
value is a JSON document::

    {"format": "mpsnn", "version": 1, "root": <value>, "objects": [<object>, ...]}

* ``<object>`` is ``{"type": <registered name>, "fields": {...}}``; what the fields are is the
  business of the type's codec (`register_codec`). An object referenced several times is
  written once and comes back as one object (a kernel and the checkpoint both referencing a
  data source, two data sources sharing an optimizer, two graphs sharing nodes). An object's
  fields reference only objects earlier in the table; every object is referenced.
* ``<value>`` is JSON ``null``, a boolean, an int, a finite float, a string or a list
  (a Python list), or a tagged JSON object with one tag: ``{"$obj": i}`` (object ``i`` of the
  table), ``{"$tensor": name, "dtype": "float32", "shape": [...]}`` (a tensor of the file),
  ``{"$dict": {...}}`` (a dict with str keys), ``{"$tuple": [...]}``, ``{"$float": "nan" |
  "inf" | "-inf"}``.

Guarantees
----------

* Loading never executes code: no pickle, no eval, no import by name. A type is resolved
  through the codec table only; an unknown type is rejected.
* A file is checked before anything is built: the safetensors header (length, JSON, entries,
  the tensor data's extent: a truncated file is rejected), the ``"mpsnn"`` document (format,
  version, keys), every tensor reference (present, with the dtype and shape the structure
  states), no tensor the structure does not reference. Codecs then check what their class
  needs (shapes against descriptors, dtypes against the parameters). Every rejection is a
  `CheckpointError` (a `ValueError`) reading ``[load] what must hold, got what``.
* Writes are atomic: the file is written to a temporary file in the target's directory
  (``.<name>.<random>.tmp``), flushed, fsynced, and renamed onto the target (then the
  directory is fsynced where the platform allows). A save that raises removes its temporary
  file; a process killed mid-save leaves the previous file intact (and possibly a stray
  temporary file, never read by `load`).
* `load` restores values bit for bit, on the device asked for: weights, optimizer state
  vectors, the optimizers' hyperparameter tensors and Adam's step, dropout counters.

`save` reads tensors on the current stream: wait for committed command buffers first.

Modules: `mpsnn.io.container` (the file, `save`, `load`), `mpsnn.io.codec` (the table, the
`Encoder` and `Fields`), and the codecs: `mpsnn.io.data_sources` (descriptors, optimizers,
data sources), `mpsnn.io.kernels` (kernels), `mpsnn.io.graph_nodes` (the forward node
recipe), `mpsnn.io.graph_training` (how a training graph's gradient nodes were made) and
`mpsnn.io.graphs` (`Graph`).
"""

from __future__ import annotations

from mpsnn.errors import CheckpointError
from mpsnn.io import data_sources as data_sources  # each codec module registers its codecs
from mpsnn.io import graph_nodes as graph_nodes
from mpsnn.io import graph_training as graph_training
from mpsnn.io import graphs as graphs
from mpsnn.io import kernels as kernels
from mpsnn.io.codec import Codec, Encoder, Fields, register_codec, registered_types
from mpsnn.io.container import FORMAT, METADATA_KEY, VERSION, load, save

__all__ = [
    "FORMAT",
    "METADATA_KEY",
    "VERSION",
    "CheckpointError",
    "Codec",
    "Encoder",
    "Fields",
    "load",
    "register_codec",
    "registered_types",
    "save",
]
