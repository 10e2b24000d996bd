"""The words and offsets of a shared all-reduce buffer's segment (the layout ``shm_buffers`` describes),
in one place for every module that reads or writes them, and for the compiled implementation, which
receives them at registration (``COMPILED_LAYOUT``)."""

from __future__ import annotations

import struct

from ...core.shared_memory import HEADER_BYTES

READY, REDUCED, DONE = 8, 16, 24      # uint64 indices of the flags (byte offsets 64, 128, 192)
INFO = 32                             # uint64 index of the piece header (byte offset 256)
DIRECT = 36                           # uint64 index (byte offset 288): a direct all-reduce's shared array:
                                      # allocation + 1 (0: none), byte offset, collective seq + 1
DIRECT_PIECE = (1 << 32) - 1          # the piece number in the header of a direct all-reduce's handshake
SIG_AT, SIG_MAX = 320, 1024           # signature text: byte offset, most bytes kept
CMA_AT = 168                          # uint64 index (byte offset 1344): a direct all-reduce's arrays for
                                      # cross-memory reads: input address, output address
ENTERED = 192                         # uint64 index (byte offset 1536): the collective this rank is in, + 1
ENTERED_SIG = 200                     # uint64 index (byte offset 1600): its signature's length; text at 1664
ENTERED_SIG_AT = 1664
SEQ = 176                             # uint64 index (byte offset 1408): this rank's next collective number
LAST_WHOLE = 177                      # uint64 index: 1 when this rank's last generation used the whole data area
STATE = 184                           # uint64 index (byte offset 1472): why this rank's compiled all-reduce stopped
SMALL_BYTES = 64 << 10                # largest all-reduce (input bytes) that takes the Python one-round path
SLOT_HEAD = struct.Struct("<QQQ")    # a slot's header: collective seq, elements, signature length
STOPPED = {1: "shut down", 2: "it found a mismatch", 3: "it timed out", 4: "it lost a peer", 5: "it failed"}
SLOT_TEXT_AT = 64                     # a slot's signature text
SLOT_DATA_AT = 64 + SIG_MAX           # a slot's data
#: the protocol's layout for its compiled implementation (shm_allreduce.cc's LayoutField, in its order):
#: word indices, then byte offsets (the data area, the slot stride added per set of buffers) and the text limit
COMPILED_LAYOUT = (READY, DONE, SEQ, LAST_WHOLE, STATE, ENTERED, ENTERED_SIG, ENTERED_SIG_AT, HEADER_BYTES)
