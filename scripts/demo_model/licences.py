"""Licence notices of the training data, reproduced in every model card. The WordNet licence
asks for its notice on all copies, including modifications, so the full text travels with
the weights.
"""

WORDNET_LICENCE = """\
WordNet Release 3.0. This software and database is being provided to you, the LICENSEE, by
Princeton University under the following license. By obtaining, using and/or copying this
software and database, you agree that you have read, understood, and will comply with these
terms and conditions.:

Permission to use, copy, modify and distribute this software and database and its
documentation for any purpose and without fee or royalty is hereby granted, provided that you
agree to comply with the following copyright notice and statements, including the disclaimer,
and that the same appear on ALL copies of the software, database and documentation, including
modifications that you make for internal use or for distribution.

WordNet 3.0 Copyright 2006 by Princeton University. All rights reserved.

THIS SOFTWARE AND DATABASE IS PROVIDED "AS IS" AND PRINCETON UNIVERSITY MAKES NO
REPRESENTATIONS OR WARRANTIES, EXPRESS OR IMPLIED. BY WAY OF EXAMPLE, BUT NOT LIMITATION,
PRINCETON UNIVERSITY MAKES NO REPRESENTATIONS OR WARRANTIES OF MERCHANT- ABILITY OR FITNESS FOR
ANY PARTICULAR PURPOSE OR THAT THE USE OF THE LICENSED SOFTWARE, DATABASE OR DOCUMENTATION WILL
NOT INFRINGE ANY THIRD PARTY PATENTS, COPYRIGHTS, TRADEMARKS OR OTHER RIGHTS.

The name of Princeton University or Princeton may not be used in advertising or publicity
pertaining to distribution of the software and/or database. Title to copyright in this
software, database and any associated documentation shall at all times remain with Princeton
University and LICENSEE agrees to preserve same."""

FORTUNES_NOTICE = """\
The fortune cookie files come from Debian's `fortunes` and `fortunes-min` packages (Debian
main, fortune-mod 1.99.1), distributed under the BSD licence of fortune-mod: Copyright (c) 1991
The Regents of the University of California. The cookie files are collections of quotations
gathered over decades by many contributors (see /usr/share/doc/fortunes/copyright); only the
tame files were used: {files}."""

OWN_TEXT_NOTICE = """\
Greeting, identity, help and refusal turns, and the question phrasings, are written in this
repository (scripts/demo_model/smalltalk.py, dataset.py) under the project's own licence."""
