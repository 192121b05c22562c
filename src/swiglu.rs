//! swiglu (in progress).
