"""The words and offsets of a shared all-reduce buffer's segment (the layout ``shm_buffers`` describes),
in one place for every module that reads or writes them."""

from __future__ import annotations

import struct


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
LAST_WHOLE = 176                      # uint64 index (byte offset 1408): 1 when this rank's last generation used
                                      # the whole data area (the next one-round slot waits for its done)
SMALL_BYTES = 64 << 10                # largest all-reduce (input bytes) that takes the one-round path
SLOT_HEAD = struct.Struct("<QQQ")    # a slot's header: collective seq, elements, signature length
SLOT_TEXT_AT = 64                     # a slot's signature text
SLOT_DATA_AT = 64 + SIG_MAX           # a slot's data
SMALL_PATH_CAPACITY = 2 * (SLOT_DATA_AT + SMALL_BYTES)  # a data area that holds exactly the two slots
