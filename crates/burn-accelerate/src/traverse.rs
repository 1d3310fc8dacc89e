//! Implementations shared by the traits that walk a batch value and act on the tensors in it
//! ([`ToDevice`](crate::ToDevice), [`CastFloats`](crate::CastFloats)): containers recurse, tuples recurse
//! element by element, and plain values pass through.

/// Implements `$trait::$method(self, arg: $arg) -> Self` for containers, tuples and plain values.
macro_rules! traverse_impls {
    ($trait:ident, $method:ident, $arg:ty) => {
        impl<T: $trait> $trait for Vec<T> {
            fn $method(self, arg: $arg) -> Self {
                self.into_iter().map(|v| v.$method(arg)).collect()
            }
        }

        impl<T: $trait, const N: usize> $trait for [T; N] {
            fn $method(self, arg: $arg) -> Self {
                self.map(|v| v.$method(arg))
            }
        }

        impl<T: $trait> $trait for Option<T> {
            fn $method(self, arg: $arg) -> Self {
                self.map(|v| v.$method(arg))
            }
        }

        impl<T: $trait> $trait for Box<T> {
            fn $method(self, arg: $arg) -> Self {
                Box::new((*self).$method(arg))
            }
        }

        impl<K: Eq + std::hash::Hash, V: $trait, S: std::hash::BuildHasher + Default> $trait
            for std::collections::HashMap<K, V, S>
        {
            fn $method(self, arg: $arg) -> Self {
                self.into_iter().map(|(k, v)| (k, v.$method(arg))).collect()
            }
        }

        impl<K: Ord, V: $trait> $trait for std::collections::BTreeMap<K, V> {
            fn $method(self, arg: $arg) -> Self {
                self.into_iter().map(|(k, v)| (k, v.$method(arg))).collect()
            }
        }

        $crate::traverse::traverse_impls!(@plain $trait, $method, $arg;
            (), bool, char, u8, u16, u32, u64, u128, usize, i8, i16, i32, i64, i128, isize, f32, f64, String,
            &'static str);
        $crate::traverse::traverse_impls!(@tuples $trait, $method, $arg;
            (A), (A, B), (A, B, C), (A, B, C, D), (A, B, C, D, E), (A, B, C, D, E, F), (A, B, C, D, E, F, G),
            (A, B, C, D, E, F, G, H));
    };
    (@plain $trait:ident, $method:ident, $arg:ty; $($t:ty),* $(,)?) => {
        $(impl $trait for $t {
            fn $method(self, _arg: $arg) -> Self {
                self
            }
        })*
    };
    (@tuples $trait:ident, $method:ident, $arg:ty; $(($($name:ident),+)),+ $(,)?) => {
        $(
            #[allow(non_snake_case)]
            impl<$($name: $trait),+> $trait for ($($name,)+) {
                fn $method(self, arg: $arg) -> Self {
                    let ($($name,)+) = self;
                    ($($name.$method(arg),)+)
                }
            }
        )+
    };
}

pub(crate) use traverse_impls;
