"""The fixed layouts read by name: a ring slot's header words (transport/slots.SlotHeader) and
a segment group's meta array (transport/segment_meta.SegmentMeta) give back what was written."""

import numpy as np

from hpcvla.roles.segments import OUTCOME_FIELDS, SegmentBuilder
from hpcvla.transport.segment_meta import SegmentMeta
from hpcvla.transport.slots import SLOT_HEADER, SlotHeader


def test_slot_header_reads_every_field_of_the_layout():
    header = np.zeros(1, SLOT_HEADER)
    fields = dict(state=8, fragment=7, producer=-3, schema=2 ** 32 - 1, seq=-5, part=1,
                  nparts=4, length=4000, record_length=15000, checksum=2 ** 64 - 2)
    for name, value in fields.items():
        header[0][name] = value
    assert SlotHeader.read(header.view(np.uint8))._asdict() == fields


def test_segment_meta_names_what_the_builder_wrote():
    builder = SegmentBuilder({"state": ((2,), "<f4")}, n_envs=3, chunk_len=2, action_dim=1,
                             segment_len=1, producer=5, slot=1)
    builder.batch = 9
    builder.add_step({"state": np.zeros((3, 2), np.float32)}, np.zeros((3, 2, 1)),
                     np.zeros(3), np.zeros(3), version=9)
    builder.record_outcome({k: np.zeros(3, dt) for k, (_, dt) in OUTCOME_FIELDS.items()})
    first = builder.finish(np.zeros(3))
    assert SegmentMeta.of(first) == SegmentMeta(producer=5, slot=1, group=0, envs=3, batch=9)
