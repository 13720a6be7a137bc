//! The safetensors header: build it byte-identically to safetensors 0.8, parse and fully validate it.
//!
//! Layout: 8-byte little-endian `N`, then `N` bytes of JSON (`{"__metadata__":{..},"name":{"dtype":..,"shape":[..],
//! "data_offsets":[b,e]},..}`), then the data section. The official writer emits compact serde_json with
//! `__metadata__` first, tensors in descending dtype rank then by name, padded with spaces to a multiple of 8.

use std::cell::RefCell;
use std::collections::HashSet;
use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, Visitor};
use serde::ser::{SerializeMap, SerializeStruct, Serializer};
use serde::{Deserialize, Serialize};

use crate::dtype::{numel, ByteSize, Dtype};
use crate::error::{Error, Result};

pub use crate::limits::MAX_HEADER_BYTES;

/// The metadata key of a header.
pub const METADATA_KEY: &str = "__metadata__";

/// One tensor's header entry. `begin`/`end` are relative to the data section.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    /// The tensor's name (fqn).
    pub name: String,
    /// Its dtype.
    pub dtype: Dtype,
    /// Its logical shape (for F4, the packed shape: a torch `[.., n]` float4_e2m1fn_x2 is `[.., 2n]`).
    pub shape: Vec<u64>,
    /// First byte, relative to the data section.
    pub begin: u64,
    /// One past the last byte, relative to the data section.
    pub end: u64,
}

/// A parsed, validated header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    /// `__metadata__` in file order, `None` when the key is absent.
    pub metadata: Option<Vec<(String, String)>>,
    /// The tensors in file (offset) order.
    pub tensors: Vec<TensorInfo>,
    /// 8 + the header length: where the data section starts in the file.
    pub data_start: u64,
}

impl Header {
    /// Length of the data section in bytes.
    pub fn data_len(&self) -> u64 {
        self.tensors.last().map_or(0, |t| t.end)
    }
}

struct MetadataRef<'a>(&'a [(String, String)]);

impl Serialize for MetadataRef<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(Some(self.0.len()))?;
        for (k, v) in self.0 {
            map.serialize_entry(k, v)?;
        }
        map.end()
    }
}

struct EntryRef<'a>(&'a TensorInfo);

impl Serialize for EntryRef<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        let mut st = s.serialize_struct("TensorInfo", 3)?;
        st.serialize_field("dtype", self.0.dtype.name())?;
        st.serialize_field("shape", &self.0.shape)?;
        st.serialize_field("data_offsets", &(self.0.begin, self.0.end))?;
        st.end()
    }
}

struct HeaderRef<'a> {
    metadata: Option<&'a [(String, String)]>,
    tensors: &'a [TensorInfo],
}

impl Serialize for HeaderRef<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        let len = self.tensors.len() + usize::from(self.metadata.is_some());
        let mut map = s.serialize_map(Some(len))?;
        if let Some(m) = self.metadata {
            map.serialize_entry(METADATA_KEY, &MetadataRef(m))?;
        }
        for t in self.tensors {
            map.serialize_entry(&t.name, &EntryRef(t))?;
        }
        map.end()
    }
}

/// The order the official writer stores tensors in: descending dtype rank, then name (bytewise).
pub fn writer_order(a: (&str, Dtype), b: (&str, Dtype)) -> std::cmp::Ordering {
    b.1.rank().cmp(&a.1.rank()).then_with(|| a.0.cmp(b.0))
}

/// Encode the 8-byte length and the padded JSON header for `tensors` (already in file order with offsets).
/// Duplicate metadata keys are an [`Error::InvalidArgument`].
pub fn encode(metadata: Option<&[(String, String)]>, tensors: &[TensorInfo]) -> Result<Vec<u8>> {
    if let Some(m) = metadata {
        let mut seen = HashSet::with_capacity(m.len());
        for (k, _) in m {
            if !seen.insert(k.as_str()) {
                return Err(Error::InvalidArgument(format!(
                    "metadata key {k:?} given twice"
                )));
            }
        }
    }
    let mut out = vec![0u8; 8];
    serde_json::to_writer(&mut out, &HeaderRef { metadata, tensors })
        .map_err(|e| Error::InvalidArgument(format!("cannot encode the header as JSON: {e}")))?;
    let padded = (out.len() - 8).next_multiple_of(8);
    if padded as u64 > MAX_HEADER_BYTES {
        let meta: usize = metadata.map_or(0, |m| m.iter().map(|(k, v)| k.len() + v.len()).sum());
        return Err(Error::InvalidArgument(format!(
            "the header would be {padded} bytes ({} tensors, {meta} bytes of metadata keys and values), over \
             the limit of {MAX_HEADER_BYTES} bytes that safetensors readers (fastckpt's and the official one) \
             accept; nothing was written. Split the tensors across more files (max_shard_size) or shorten \
             the metadata",
            tensors.len()
        )));
    }
    out.resize(8 + padded, b' ');
    out[..8].copy_from_slice(&(padded as u64).to_le_bytes());
    Ok(out)
}

/// Check the first 8 bytes of a file of `file_size` bytes and return the header length `N`.
pub fn header_len(prefix: &[u8], file_size: u64, file: &str) -> Result<u64> {
    let truncated = |what: &str, expected: u64| Error::Truncated {
        path: file.to_string(),
        what: what.to_string(),
        expected,
        actual: file_size,
    };
    let first8: [u8; 8] = prefix
        .get(..8)
        .and_then(|s| s.try_into().ok())
        .ok_or_else(|| truncated("the 8-byte header length", 8))?;
    let n = u64::from_le_bytes(first8);
    if n > MAX_HEADER_BYTES {
        return Err(Error::Header(format!(
            "{file}: header length {n} bytes is over the limit of {MAX_HEADER_BYTES} bytes \
             (file size {file_size} bytes)"
        )));
    }
    if 8 + n > file_size {
        return Err(truncated("the header", 8 + n));
    }
    Ok(n)
}

/// Parse and validate the JSON header `json` of a file of `file_size` bytes whose data section starts at
/// `8 + json.len()`. Every rule of CORE_API.md is checked; the tensors come back in offset order.
pub fn parse(json: &[u8], file_size: u64, file: &str) -> Result<Header> {
    let bad = |msg: String| Error::Header(format!("{file}: {msg}"));
    let text =
        std::str::from_utf8(json).map_err(|e| bad(format!("header is not valid UTF-8: {e}")))?;
    if !text.starts_with('{') {
        let got: String = text.chars().take(16).collect();
        return Err(bad(format!(
            "header does not start with '{{' (starts with {got:?})"
        )));
    }
    let raw = parse_json(text).map_err(|e| {
        bad(format!(
            "header is not a valid safetensors JSON object: {e}"
        ))
    })?;

    let mut tensors = Vec::with_capacity(raw.entries.len());
    for (name, e) in raw.entries {
        let dtype = Dtype::parse_for(&e.dtype, &name, file)?;
        let [begin, end] = e.data_offsets;
        let n = numel(&e.shape)
            .ok_or_else(|| bad(format!("tensor {name:?}: shape {:?} overflows", e.shape)))?;
        let bytes = match dtype.bytes_for(n) {
            ByteSize::Exact(b) => b,
            ByteSize::NotWhole => {
                return Err(bad(format!(
                    "tensor {name:?}: shape {:?} of {dtype} is {n} x {} bits, not a whole number of bytes",
                    e.shape,
                    dtype.bits()
                )))
            }
            ByteSize::Overflow => return Err(bad(format!("tensor {name:?}: shape {:?} overflows", e.shape))),
        };
        if begin > end {
            return Err(bad(format!(
                "tensor {name:?}: data_offsets [{begin}, {end}] begin after end"
            )));
        }
        if end - begin != bytes {
            return Err(bad(format!(
                "tensor {name:?}: data_offsets [{begin}, {end}] span {} bytes but shape {:?} of {dtype} \
                 needs {bytes}",
                end - begin,
                e.shape
            )));
        }
        tensors.push(TensorInfo {
            name,
            dtype,
            shape: e.shape,
            begin,
            end,
        });
    }
    tensors.sort_by_key(|t| (t.begin, t.end));
    let mut at = 0u64;
    for t in &tensors {
        if t.begin != at {
            let what = if t.begin > at { "a hole" } else { "an overlap" };
            return Err(bad(format!(
                "tensor {:?}: data_offsets [{}, {}] leave {what}: the previous tensor ends at {at}",
                t.name, t.begin, t.end
            )));
        }
        at = t.end;
    }
    let data_start = 8 + json.len() as u64;
    let data_len = file_size - data_start;
    if at > data_len {
        return Err(Error::Truncated {
            path: file.to_string(),
            what: "the data section".to_string(),
            expected: data_start + at,
            actual: file_size,
        });
    }
    if at < data_len {
        return Err(bad(format!(
            "data section is {data_len} bytes but the tensors end at {at}: {} extra bytes",
            data_len - at
        )));
    }
    Ok(Header {
        metadata: raw.metadata,
        tensors,
        data_start,
    })
}

/// Validate a whole in-memory file (header and sizes; the data bytes are not read).
pub fn parse_file(data: &[u8], file: &str) -> Result<Header> {
    let size = data.len() as u64;
    let n = header_len(data, size, file)?;
    parse(&data[8..8 + n as usize], size, file)
}

/// One entry exactly as written: the three fields, no others, of the right JSON types.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawEntry {
    dtype: String,
    shape: Vec<u64>,
    data_offsets: [u64; 2],
}

/// The header object in file order, with duplicate names rejected (serde_json would keep the last).
struct RawHeader {
    metadata: Option<Vec<(String, String)>>,
    entries: Vec<(String, RawEntry)>,
}

/// Parse the header JSON; on failure the message says which entry was being read.
fn parse_json(text: &str) -> std::result::Result<RawHeader, String> {
    let at = RefCell::new(String::new());
    let mut de = serde_json::Deserializer::from_str(text);
    let parsed = de
        .deserialize_map(HeaderVisitor { at: &at })
        .and_then(|h| de.end().map(|()| h));
    parsed.map_err(|e| match at.borrow().as_str() {
        "" => e.to_string(),
        place => format!("{place}: {e}"),
    })
}

/// Visits the top-level object; `at` records the entry being read, for error messages.
struct HeaderVisitor<'a> {
    at: &'a RefCell<String>,
}

impl<'de> Visitor<'de> for HeaderVisitor<'_> {
    type Value = RawHeader;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object of tensor entries")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> std::result::Result<RawHeader, A::Error> {
        let mut metadata = None;
        let mut entries = Vec::new();
        let mut seen = HashSet::new();
        while let Some(key) = map.next_key::<String>()? {
            if !seen.insert(key.clone()) {
                return Err(de::Error::custom(format_args!("duplicate key {key:?}")));
            }
            if key == METADATA_KEY {
                *self.at.borrow_mut() = METADATA_KEY.to_string();
                metadata = Some(map.next_value_seed(StringMapVisitor { at: self.at })?);
            } else {
                *self.at.borrow_mut() = format!("tensor {key:?}");
                entries.push((key, map.next_value::<RawEntry>()?));
            }
            self.at.borrow_mut().clear();
        }
        Ok(RawHeader { metadata, entries })
    }
}

/// `__metadata__`: an object of string to string, order kept, duplicate keys rejected.
struct StringMapVisitor<'a> {
    at: &'a RefCell<String>,
}

impl<'de> DeserializeSeed<'de> for StringMapVisitor<'_> {
    type Value = Vec<(String, String)>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> std::result::Result<Self::Value, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for StringMapVisitor<'_> {
    type Value = Vec<(String, String)>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("__metadata__ as an object of string to string")
    }

    fn visit_map<A: MapAccess<'de>>(
        self,
        mut map: A,
    ) -> std::result::Result<Self::Value, A::Error> {
        let mut out: Vec<(String, String)> = Vec::new();
        let mut seen = HashSet::new();
        while let Some(k) = map.next_key::<String>()? {
            if !seen.insert(k.clone()) {
                return Err(de::Error::custom(format_args!("duplicate key {k:?}")));
            }
            *self.at.borrow_mut() = format!("__metadata__ key {k:?}");
            let v = map.next_value::<String>()?;
            out.push((k, v));
        }
        Ok(out)
    }
}

#[cfg(test)]
#[path = "header_tests.rs"]
mod tests;
