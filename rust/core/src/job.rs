//! One file to write: its target path, its tensors and its metadata. The writer takes a list of them; a
//! write's progress numbers their tensors (job 0's in input order, then job 1's, ...).

use std::path::PathBuf;

use crate::source::TensorSource;

/// One file to write.
#[derive(Debug, Clone)]
pub struct FileJob<'a> {
    /// The target path.
    pub path: PathBuf,
    /// Its tensors, in any order.
    pub tensors: Vec<TensorSource<'a>>,
    /// `__metadata__` (order kept); `None` writes no metadata key.
    pub metadata: Option<Vec<(String, String)>>,
}
