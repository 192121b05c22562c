//! rope (in progress).
